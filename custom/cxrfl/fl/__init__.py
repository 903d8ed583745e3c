"""NVFlare glue: executors, controllers and aggregators around the framework-free core."""
