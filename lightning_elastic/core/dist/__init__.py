"""Agreement between ranks: the coordinator (collectives on a dedicated gloo group), the commit
channel (reports and decisions through the c10d store), and rank 0's commit."""
