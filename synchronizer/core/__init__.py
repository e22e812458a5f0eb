"""The synchronizer's pure core: decisions over plain values, no gRPC, Redis, event loop or
store (an import-linter contract holds it so). When a round merges (`rounds`), how its
updates combine (`merge`), which updates and fields are admitted (`admission`), and the
bookkeeping they read (`recent`, `open_round`). Unit-tested without a network.
"""
