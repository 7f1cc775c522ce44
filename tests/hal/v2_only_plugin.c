/* A plugin built for a later ABI: it exports only dt_hal_plugin_v2. dt must name both versions. */
__attribute__((visibility("default"))) const void* dt_hal_plugin_v2(void) { return 0; }
