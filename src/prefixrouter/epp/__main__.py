"""``python -m prefixrouter.epp [--config FILE] [--worker URL ...] [--port GRPC]``."""

from prefixrouter.epp.cli import main

if __name__ == "__main__":
    main()
