"""
What the course's commands share, below the front door that runs them (prefix_caching.py,
`python prefix_caching.py --MODE`) and server.py: the flags every command line parses
(flags.py, and model_flags.py: a model, a device, a pool), the walkthrough of the design doc's
example (walkthrough.py) and the demo (demo.py).
"""
