"""Device meshes, the logical-axis rules table, config-vs-mesh validation, devices and XLA flags."""
