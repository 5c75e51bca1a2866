"""Engines: what delivers a Strategy's Messages to Clients. ``embedded`` runs every client in this
process; ``flower`` runs the same objects as a Flower ServerApp / ClientApp."""
