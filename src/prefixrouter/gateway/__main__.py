"""``python -m prefixrouter.gateway [--config FILE] [--worker URL ...] [--port P]``."""

from prefixrouter.gateway.cli import main

if __name__ == "__main__":
    main()
