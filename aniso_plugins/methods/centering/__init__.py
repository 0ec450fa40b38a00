"""Output-embedding centering: μ-centering and μ-loss (Stollenwerk, Lokrantz & Hertzberg 2026)."""
