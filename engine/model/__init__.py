"""Models, their loader and attention backends (registered in ``pagedserve.engine.model.attention``)."""
