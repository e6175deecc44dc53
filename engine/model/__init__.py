"""Models, their loader and attention backends (registered in ``engine.model.attention``)."""
