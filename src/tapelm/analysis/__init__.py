"""What every result-writing part shares and nothing above the model needs to know about runs: intervals, paired
differences and verdicts (`statistics`), the markdown tables spliced between markers (`markdown`), and the figures
(`plots`). It imports nothing else of tapelm."""
