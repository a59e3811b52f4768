"""kiln's native core, seen from Python: thin numpy wrappers over the `kiln._native` extension."""
