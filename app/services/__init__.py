"""Application services: the logic behind the routes (routes only parse, authorise and delegate)."""
