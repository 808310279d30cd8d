"""A tiny random-weight GGUF model that a real ``llama-server`` will serve.

Tests of the serving path (slots, prompt cache, grammar, chat templates) need
a server that tokenizes, templates and decodes for real, but not a model that
says anything sensible. Downloading weights is not possible in CI, so we
build one: the tokenizer (and its chat template) is copied from one of the
vocab-only GGUFs that ship with llama.cpp, and the transformer is a couple of
64-wide layers of seeded noise. The file is ~20 MB (almost all of it the
f16 token embedding, which doubles as the tied output head) and takes about
a second to write.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

#: Architectures whose tensor layout :func:`write_tiny_model` knows.
#: ``qwen2`` has Q/K/V biases, ``qwen3`` has per-head Q/K norms, ``llama`` neither.
SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama")

_TOKENIZER_PREFIX = "tokenizer."
_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


# Little-endian struct formats of GGUF's fixed-size metadata types.
_SCALAR_FORMATS: dict[gguf.GGUFValueType, str] = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}

_KV = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


class _MetadataParser:
    """Just enough of a GGUF v2/v3 metadata reader to copy a tokenizer.

    ``gguf.GGUFReader`` builds a numpy view per string, which for a 150k-token
    BPE vocab plus its merges takes several seconds; walking the bytes takes a
    fraction of one. Strings stay ``bytes`` (the writer accepts them as is),
    so nothing is decoded and re-encoded.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def scalar(self, vtype: gguf.GGUFValueType) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def u32(self) -> int:
        return int(self.scalar(gguf.GGUFValueType.UINT32))

    def u64(self) -> int:
        return int(self.scalar(gguf.GGUFValueType.UINT64))

    def string(self) -> bytes:
        n = self.u64()
        start, self.pos = self.pos, self.pos + n
        return self.data[start : self.pos]

    def value(self, vtype: gguf.GGUFValueType) -> tuple[Any, gguf.GGUFValueType | None]:
        """Returns ``(value, array_item_type)``; the latter is None for non-arrays."""
        if vtype == gguf.GGUFValueType.STRING:
            return self.string(), None
        if vtype != gguf.GGUFValueType.ARRAY:
            return self.scalar(vtype), None
        item_type = gguf.GGUFValueType(self.u32())
        n = self.u64()
        if item_type == gguf.GGUFValueType.STRING:
            return [self.string() for _ in range(n)], item_type
        if item_type == gguf.GGUFValueType.ARRAY:
            raise ValueError("nested GGUF arrays are not supported")
        fmt = _SCALAR_FORMATS[item_type]
        items = list(struct.unpack_from(f"<{n}{fmt[1:]}", self.data, self.pos))
        self.pos += n * struct.calcsize(fmt)
        return items, item_type

    def metadata(self) -> Iterator[_KV]:
        """Yields every metadata key with its decoded value and types."""
        if self.data[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        self.pos = 4
        if self.u32() < 2:
            raise ValueError("GGUF v1 files are not supported")
        self.u64()  # tensor count
        for _ in range(self.u64()):
            key = self.string().decode("utf-8")
            vtype = gguf.GGUFValueType(self.u32())
            value, item_type = self.value(vtype)
            yield key, value, vtype, item_type


def read_tokenizer_metadata(vocab_gguf: Path) -> list[_KV]:
    """Returns the ``tokenizer.*`` fields of a GGUF as ``(key, value, type, item_type)``.

    The tuples feed ``GGUFWriter.add_key_value`` unchanged.
    """
    parser = _MetadataParser(Path(vocab_gguf).read_bytes())
    return [kv for kv in parser.metadata() if kv[0].startswith(_TOKENIZER_PREFIX)]


def _rng_tensor(
    rng: np.random.Generator,
    shape: tuple[int, ...],
    *,
    std: float,
    dtype: type[np.floating[Any]] = np.float32,
) -> npt.NDArray[Any]:
    """Gaussian noise of ``shape`` (numpy order, i.e. ggml ``ne`` reversed)."""
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)


def write_tiny_model(
    path: Path,
    *,
    vocab_gguf: Path,
    arch: str = "qwen2",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_ctx: int = 4096,
    seed: int = 0,
    n_head_kv: int | None = None,
    n_ff: int | None = None,
    chat_template: str | None = None,
) -> Path:
    """Writes a tiny random-weight model with a real tokenizer to ``path``.

    The output is a function of the arguments only (same seed, same bytes),
    so a session-scoped fixture may cache it.

    Args:
        path: Where to write the ``.gguf`` file (parent directories are created).
        vocab_gguf: A vocab-only GGUF from llama.cpp's ``models/`` directory,
            e.g. ``ggml-vocab-qwen2.gguf``; all its ``tokenizer.*`` metadata,
            including ``tokenizer.chat_template``, is copied.
        arch: One of :data:`SUPPORTED_ARCHS`; should match the vocab's family
            only in spirit, llama.cpp does not check.
        n_layer: Transformer blocks.
        n_embd: Hidden width; must be divisible by ``n_head``.
        n_head: Attention heads.
        n_ctx: Training context length written to the metadata. Keep it at
            least the per-slot context the server will use, or llama.cpp
            warns about overflowing the training context.
        seed: Seed for the weights.
        n_head_kv: KV heads (GQA); defaults to ``n_head``.
        n_ff: Feed-forward width; defaults to ``4 * n_embd``.
        chat_template: Replaces the vocab's chat template, e.g. with a
            tool-call-capable one from llama.cpp's ``models/templates``.

    Returns:
        ``path``, for chaining.

    Raises:
        ValueError: On an unsupported ``arch`` or inconsistent sizes.
        FileNotFoundError: If ``vocab_gguf`` does not exist.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch {arch!r} not supported; choose one of {SUPPORTED_ARCHS}")
    n_head_kv = n_head if n_head_kv is None else n_head_kv
    n_ff = 4 * n_embd if n_ff is None else n_ff
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd={n_embd}, n_head={n_head}, n_head_kv={n_head_kv} do not divide evenly")
    if not Path(vocab_gguf).is_file():
        raise FileNotFoundError(f"vocab GGUF not found: {vocab_gguf}")

    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    tokenizer = read_tokenizer_metadata(vocab_gguf)
    tokens = next((kv[1] for kv in tokenizer if kv[0] == "tokenizer.ggml.tokens"), None)
    if not tokens:
        raise ValueError(f"{vocab_gguf} has no tokenizer.ggml.tokens")
    n_vocab = len(tokens)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"fusion-graph tiny {arch} (random weights, seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_dimension_count(head_dim)
    for key, value, vtype, sub_type in tokenizer:
        if key == _CHAT_TEMPLATE_KEY and chat_template is not None:
            continue
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)
    # Small std keeps activations tame through RMS norms; f16 halves the one
    # big tensor. There is no output.weight: llama.cpp ties it to token_embd.
    writer.add_tensor("token_embd.weight", _rng_tensor(rng, (n_vocab, n_embd), std=0.02, dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w = 1.0 / np.sqrt(n_embd)
    for i in range(n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_q.weight", _rng_tensor(rng, (n_embd, n_embd), std=w))
        writer.add_tensor(f"{blk}.attn_k.weight", _rng_tensor(rng, (n_embd_kv, n_embd), std=w))
        writer.add_tensor(f"{blk}.attn_v.weight", _rng_tensor(rng, (n_embd_kv, n_embd), std=w))
        if arch == "qwen2":
            writer.add_tensor(f"{blk}.attn_q.bias", _rng_tensor(rng, (n_embd,), std=0.02))
            writer.add_tensor(f"{blk}.attn_k.bias", _rng_tensor(rng, (n_embd_kv,), std=0.02))
            writer.add_tensor(f"{blk}.attn_v.bias", _rng_tensor(rng, (n_embd_kv,), std=0.02))
        if arch == "qwen3":
            writer.add_tensor(f"{blk}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_output.weight", _rng_tensor(rng, (n_embd, n_embd), std=w))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", _rng_tensor(rng, (n_ff, n_embd), std=w))
        writer.add_tensor(f"{blk}.ffn_up.weight", _rng_tensor(rng, (n_ff, n_embd), std=w))
        writer.add_tensor(f"{blk}.ffn_down.weight", _rng_tensor(rng, (n_embd, n_ff), std=1.0 / np.sqrt(n_ff)))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fusion_graph_testing.tiny_model OUT.gguf``: write the tests' tiny model, print its path.

    The tokenizer comes from the vocab GGUFs of the built llama-server
    (``scripts/build_llama_server.sh``); the weights are random, so answers are
    noise, but a real llama-server serves it on any CPU in milliseconds a token.
    """
    import argparse

    from fusion_graph_testing.llama_server import LlamaServerNotBuilt, vocab_path

    parser = argparse.ArgumentParser(
        prog="python -m fusion_graph_testing.tiny_model", description=(main.__doc__ or "").split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="where to write the .gguf file")
    parser.add_argument("--vocab", default="qwen2", help="llama.cpp vocab (models/ggml-vocab-NAME.gguf)")
    parser.add_argument("--n-ctx", type=int, default=32768, help="training context written to the metadata")
    args = parser.parse_args(argv)
    try:
        vocab = vocab_path(args.vocab)
    except LlamaServerNotBuilt as error:
        parser.error(f"{error}: build llama-server first (bash scripts/build_llama_server.sh)")
    print(write_tiny_model(args.out, vocab_gguf=vocab, n_ctx=args.n_ctx))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
