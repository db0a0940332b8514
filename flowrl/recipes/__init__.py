"""Training loops, one file per loop shape (recipes are leaf code)."""
