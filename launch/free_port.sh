# Sourced: prints nothing, sets PORT to a free TCP port on 127.0.0.1 (unless PORT is set).
PORT="${PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
