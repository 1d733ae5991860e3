"""Test-only helpers shipped with hvdray (fault injection); nothing here runs unless a test asks for it."""
