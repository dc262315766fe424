"""What every layer uses: logging, small files written whole, processes, the run ledger, the
start-up guards."""
