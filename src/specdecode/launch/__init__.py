"""What `specdecode bench` and `specdecode loadtest` share, torch-free: other tools' servers and ours started on a
loopback port (servers.py: their command lines, the process waited for and stopped), llama.cpp's llama-server
built offline into the cache (llama_server.py), the prompt files (prompts.py) and the lines on the machine that
open a report (describe.py)."""
