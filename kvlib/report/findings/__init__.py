"""The findings page: the paper's five findings' verdicts (verdicts, with finding 2's throughput claims), the
overview figure (overview) and the table of what each system keeps, reads and evicts (systems)."""
