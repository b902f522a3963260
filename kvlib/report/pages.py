"""Each page's one family of tested statements (kvlib.report.stats.family), declared before any data is read: a
section's weight never depends on what the rows hold, so a chapter that shows another page's section reads it at the
same level and prints the same objects."""

from kvlib.report.stats import PageFamily

# Findings 1 and 3 read OOM boundaries and booked bytes, the same every run: nothing for an error rate to cover.
# The others weigh by their declared claims: finding 2 six (one not testable on a CPU, its share then unspent),
# finding 4 four, finding 5 three; so each claim's share is 5 % / 13, and finding 2's Holm runs at 6 / 13 of 5 %.
FINDINGS = PageFamily("findings", (("finding 2", 6), ("finding 4", 4), ("finding 5", 3)))

# The accuracy chapter: the multiple-choice tasks' drops (its lead reads the same objects), RULER's, the frontier's.
ACCURACY = PageFamily("accuracy", (("multiple choice", 1), ("RULER", 1), ("the frontier", 1)))

# A timing chapter tests at most one statement, its lead's comparison of the first runner with the next
# (kvlib.report.answers); its other ratios are described with their interval and no verdict word.
TIMING = PageFamily("timing", (("the lead", 1),))
