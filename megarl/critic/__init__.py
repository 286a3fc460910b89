"""The critic: values and the value update, on the actor's packing, schedule and optimizer."""
