"""Errors a user's request can cause. Each names the offending field (`param`) and the limit,
so the server can answer with a 400 that points at it and the engine can keep serving."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
