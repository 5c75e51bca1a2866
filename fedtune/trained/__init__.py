"""What a finished run leaves, put to use: its model reloaded (:mod:`.loader`), exported for
serving or the hub (:mod:`.export`, ``fedtune export``) and scored on evaluation sets
(:mod:`.evaluate`, ``fedtune eval``)."""
