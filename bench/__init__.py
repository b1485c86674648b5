"""CPU/gloo benchmarks of the CP core (collectives, memory, step time) and a prepared H200 script.

Run each as `python -m bench.<name>` from the repository root; each prints markdown tables. See docs/performance.md.
"""
