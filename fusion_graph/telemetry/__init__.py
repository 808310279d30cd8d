"""What a deployment shows its operators: Prometheus metrics and OpenTelemetry spans of every inference.

Both are opt-in operator settings (``FUSION_METRICS``, ``FUSION_TRACES``);
while off, neither ``prometheus_client`` nor OpenTelemetry is imported, and each
hook on the step's path is one attribute test. The hooks sit where the flow
already has one place for a thing: an inference's record (``providers.chain``),
a tool call (the ``ToolNode`` hook) and a run (``run_queue``).

- ``switch``: the process's telemetry (``ACTIVE``), turned on by ``build_graph`` from the settings
- ``metrics``: the Prometheus metrics, counted from each inference's record
- ``endpoint``: ``/metrics`` on ``metrics_host:metrics_port``: one thread, bounded idle connections
- ``traces``: the OpenTelemetry spans (GenAI semantic conventions, and the routing decision)
"""
