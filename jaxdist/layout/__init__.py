"""Device meshes, the logical-axis rules table, config-vs-mesh validation, devices, XLA flags and native libraries' output."""
