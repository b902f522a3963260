"""Each page's one family of tested statements (kvlib.report.stats.family), declared before any data is read: a
section's weight never depends on what the rows hold, so a chapter that shows another page's section reads it at the
same level and prints the same objects."""

from kvlib.report.stats import PageFamily

# Findings 1 and 3 are checks, not tested claims (a configured capacity's OOM boundary; a host tier only InfiniGen
# has): outside the family (kvlib.report.findings.verdicts.CHECKS). The others weigh by their declared claims: finding 2 six
# (one not testable on a CPU, one untested where a runner or the configured capacity rules it out: their shares then
# unspent), finding 4 eight (on the paper's six tasks, averaged over tasks: kvlib.report.accuracy.paper_tasks.CLAIMS),
# finding 5 three; so each claim's share is ALPHA over their sum, and finding 2's Holm runs at 6 of it.
FINDINGS = PageFamily("findings", (("finding 2", 6), ("finding 4", 8), ("finding 5", 3)))

# The accuracy chapter: the multiple-choice tasks' drops (its lead reads the same objects), RULER's, the frontier's,
# and the trend of the paper's tasks' losses with model size (its lead's sentence on what carries to 8B, the findings
# page's line beside finding 4: kvlib.report.accuracy.paper_sizes), each a section.
ACCURACY = PageFamily("accuracy", (("multiple choice", 1), ("RULER", 1), ("the frontier", 1), ("model size", 1)))

# The chooser: each answer to a workload (`kvlib choose`, a row of the chooser page's regimes table) is one family: a
# quarter to the accuracy intervals against the tolerance (every lossy policy on every task scored at the budget read:
# kvlib.report.choose.evidence), half to the decode answer's ties, a quarter to the TTFT answer's (the comparison
# with the best at one grid point, its pick allowed for: kvlib.report.stats.best.compare_with_best). Why an answer
# and not the page: the table's rows are separate questions that reread the same grid points with the same tests, and
# a page-wide share, divided again among the grid points the decode question reads, would ask for more rounds than
# the embedded book runs before two runners could be told apart (methods' table of rounds).
CHOOSER = PageFamily("chooser answer", (("accuracy", 1), ("decode", 2), ("TTFT", 1)))
SERVING = PageFamily("serving", (("accuracy", 1),))

# A timing chapter tests at most one statement, its lead's comparison of the first runner with the next
# (each chapter module's `lead`); its other ratios are described with their interval and no verdict word.
TIMING = PageFamily("timing", (("the lead", 1),))
