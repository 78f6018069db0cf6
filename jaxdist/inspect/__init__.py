"""Reading what ran: HLO and its collectives, the compiled-step report, traces and the bottleneck report, plots."""
