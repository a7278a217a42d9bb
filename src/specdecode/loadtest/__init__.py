"""`specdecode loadtest`: streamed OpenAI requests at several concurrencies against servers (running ones, or
llama-server and ours launched here), and the soak test (--soak: load and faults against one server).

cli.py: the command and its arguments; client.py: the load client and its statistics; peers.py: the launched
servers measured level by level (their command lines and processes: launch/servers.py); procmem.py: their memory
and CPU; report.py: loadtest.json, loadtest.md, loadtest.png; soak.py, soak_run.py, soak_check.py: the soak
test's traffic, phases and judgement. No module here imports torch (a structure test checks it): the client runs
beside the servers it measures; only --launch's model names are resolved through backends/, which loads it.
"""
