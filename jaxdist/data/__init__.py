"""Input pipelines. Every source yields, for global step k, the same global batch
whatever the number of processes; each process keeps only its own rows."""
