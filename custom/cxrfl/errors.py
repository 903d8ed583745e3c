"""Errors a user can act on. Each message names the file (and row or column) and what to do."""

from __future__ import annotations


class CxrflError(Exception):
    """Base class: an error whose message is meant for the operator, printed without traceback."""


class ConfigError(CxrflError):
    """A site or job configuration that cannot be used."""


class DataError(CxrflError):
    """Label files or images that cannot be read or are inconsistent."""


class UpdateRejected(CxrflError):
    """A site's model update that fails validation (NaN, wrong shapes, unknown classes ...)."""


class StorageError(CxrflError):
    """A run file that could not be written (disk full, no permission, read-only disk)."""
