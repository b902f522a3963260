"""What a policy books and allocates through: the memory ledger (bytes by tier and component), the block pool (paged
KV storage), and the timers (seconds by named section)."""
