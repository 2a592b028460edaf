"""WHERE it runs: process groups, ranks, ports, timeouts and failures."""
