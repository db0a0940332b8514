"""Training loops, one file per loop shape (recipes are leaf code), and what every loop shares: the run's state,
its setup and bookkeeping, its adapter snapshots, the diversity guard and the held-out guard."""
