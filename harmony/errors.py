"""The errors Harmony raises for problems a user can fix; each message says the cause and what to do."""


class HarmonyError(Exception):
    """Base class: an error whose message is meant for the user, printed without a traceback by the CLI."""


class ModelFileError(HarmonyError):
    """The model file is missing, fails to import, or lacks a required function."""


class DecomposeError(HarmonyError):
    """The model could not be traced or cut into layers."""


class FormatError(HarmonyError):
    """A Harmony file (graph, profile, plan, checkpoint) is corrupt, truncated or of another version."""
