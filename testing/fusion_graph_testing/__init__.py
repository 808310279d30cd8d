"""Test harness for fusion-graph: a real ``llama-server``, a tiny model for it to serve, and ``smg``.

A distribution of its own (``fusion-graph-testing``, under ``testing/`` in the
repository), as LangChain ships ``langchain-tests``: the ``fusion-graph`` wheel
is the runtime, and this harness needs packages the runtime does not
(``gguf``, ``numpy``). Tests, benchmarks, notebooks and downstream projects
install it to start the same server the integration tests use; ``fusion_graph``
never imports it (``tests/unit/test_wheel.py`` checks). The model writer is
imported lazily, so using only the server helpers does not load ``gguf`` and
``numpy``. :class:`Gateway` runs the ``smg`` gateway (the ``pool`` extra) in
front of several servers; :class:`LangGraphServer` runs the graph on several
``langhost serve`` worker processes sharing a Postgres run queue and a Redis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fusion_graph_testing.gateway import (
    DEFAULT_ROUTING_KEY_HEADER,
    ROUTED_WORKER_HEADER,
    Gateway,
    GatewayError,
    GatewayNotInstalled,
    ensure_smg,
    find_smg,
    served_by,
    smg_version,
)
from fusion_graph_testing.langgraph_server import (
    LangGraphServer,
    LangGraphServerError,
    LangGraphServerNotInstalled,
    LangGraphWorker,
    RedisServer,
    RunAttempt,
    ensure_langhost,
    ensure_redis_server,
    find_langhost,
    find_redis_server,
)
from fusion_graph_testing.llama_server import (
    DEFAULT_LLAMA_CPP_PYTHON_VERSION,
    TOOLS_TEMPLATE,
    LlamaServer,
    LlamaServerError,
    LlamaServerNotBuilt,
    build_script,
    cache_dir,
    chat_template,
    ensure_llama_server,
    find_llama_server,
    free_port,
    supports_flag,
    vocab_dir,
    vocab_path,
    write_chat_template,
)

if TYPE_CHECKING:
    from fusion_graph_testing.tiny_model import SUPPORTED_ARCHS, read_tokenizer_metadata, write_tiny_model

_LAZY = {"SUPPORTED_ARCHS", "read_tokenizer_metadata", "write_tiny_model"}

__all__ = [
    "DEFAULT_LLAMA_CPP_PYTHON_VERSION",
    "DEFAULT_ROUTING_KEY_HEADER",
    "ROUTED_WORKER_HEADER",
    "SUPPORTED_ARCHS",
    "TOOLS_TEMPLATE",
    "Gateway",
    "GatewayError",
    "GatewayNotInstalled",
    "LangGraphServer",
    "LangGraphServerError",
    "LangGraphServerNotInstalled",
    "LangGraphWorker",
    "LlamaServer",
    "LlamaServerError",
    "LlamaServerNotBuilt",
    "RedisServer",
    "RunAttempt",
    "build_script",
    "cache_dir",
    "chat_template",
    "ensure_langhost",
    "ensure_llama_server",
    "ensure_redis_server",
    "ensure_smg",
    "find_langhost",
    "find_llama_server",
    "find_redis_server",
    "find_smg",
    "free_port",
    "read_tokenizer_metadata",
    "served_by",
    "smg_version",
    "supports_flag",
    "vocab_dir",
    "vocab_path",
    "write_chat_template",
    "write_tiny_model",
]


def __getattr__(name: str) -> Any:
    """Imports the ``gguf``-dependent names on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module("fusion_graph_testing.tiny_model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
