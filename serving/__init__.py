"""
The serving parts of server.py (at the top of the repository), in reading order: what a
client sends, checked and answered (requests.py), the cache views /cache and /health read
(views.py), the connections a class opens (connections.py), and the routes (routes.py).
server.py is the command that puts them in front of one Engine.
"""
