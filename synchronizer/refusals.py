"""Refusals at the gRPC edge: a core `Rejection`'s status as gRPC's own.

The admission rules (`core/admission.py`) know no gRPC; the calls that answer with their
refusals (Session, Ingest, Follow, FetchState) turn each one into a status code here.
"""

from __future__ import annotations

import grpc

from synchronizer.core.admission import Rejection, Status


def grpc_code(status: Status) -> grpc.StatusCode:
    """gRPC's status code of the same number."""
    return grpc.StatusCode[status.name]


def grpc_status(rejection: Rejection) -> tuple[grpc.StatusCode, str]:
    """A rejection as a call aborts with it: (status code, details)."""
    return grpc_code(rejection.code), rejection.message
