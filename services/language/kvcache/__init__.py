"""KV storage: the token-slot pool, its allocator and the radix prefix cache."""
