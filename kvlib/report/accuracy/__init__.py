"""The accuracy chapter (paper Fig. 7 and the book's own tasks): its lead and sentences (lines), figures, tables, the
paper's six tasks as finding 4 reads them (paper_tasks, paper_beside, paper_sizes, fig7) and the frontier of hybrid
budgets (frontier)."""
