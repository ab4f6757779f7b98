"""The NATS side of the workers' lives and deaths: what a dead worker held is NAKed (deaths.py),
what was on its wire is found (in_transit.py), peers on the same consumer share what they NAK
(peers.py), the living are watched and their long jobs kept alive with +WPI (watch.py). Every NAK
here is by stream sequence, so each is sent only with proof no live process holds the delivery
(docs/RELIABILITY.md)."""
