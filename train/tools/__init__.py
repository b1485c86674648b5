"""Tools around the CP core, not part of a training run: drafting and checking CP plans for any diffusers model
(`python -m train.tools.draft_plan`, `python -m train.tools.check_plan`), tiny instances of any transformer and a trace
of their forward (probe.py), the pipeline-form serial oracle every CP comparison is made against (oracle.py), and a
spawner of real gloo process groups on CPU (spawn.py). The runtime (train/cp/) imports none of them."""
