"""Tools around the engine, not part of it: the offline benchmark (`bench`), the lifetime stress
harness (`stress`), the determinism grid check (`determinism`), trace plots (`plot`) and random-weight
test models (`tiny`). They use the engine's public API; the engine core never imports this package."""
