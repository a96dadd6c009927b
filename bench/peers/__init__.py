"""Side-by-side peer benchmark (issue L): our stack against vLLM's CPU build.

Same checkpoint, same dtype, same client, same run. ``python -m bench.peers`` (or
``make bench-peers``) installs vLLM (and optionally ``aiperf``) into venvs of their own under
``.peers/`` (never the project's ``.venv``), starts both servers on 127.0.0.1 and drives each
with one async streaming OpenAI client, alternating between them cell by cell.

Modules, one job each: ``venvs`` (venv + stamp helpers), ``install_vllm`` / ``install_aiperf``
/ ``install_lm_eval`` (the installers; lm-eval, like aiperf, also runs in
``tests/slow/test_third_party_clients.py``), ``vllm_server`` (starts and stops ``vllm serve``),
``ours`` (our local stack), ``dtypes`` (what ``auto`` means), ``workloads`` (request bodies),
``client`` (the streaming client), ``stats`` (aggregation), ``aiperf`` (a run of NVIDIA's
``aiperf``), ``table`` (printing) and ``driver`` (the whole benchmark).
"""
