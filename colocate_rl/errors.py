"""Errors the user can fix. The CLI prints them one per line and exits 2, without a traceback."""


class UserError(Exception):
    """Bad input (recipe, file, flag). `lines` holds one self-contained message per problem."""

    def __init__(self, *lines: str):
        self.lines = [line for line in lines if line]
        super().__init__("\n".join(self.lines))
