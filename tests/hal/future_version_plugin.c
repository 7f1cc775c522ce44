/* A plugin built for a later ABI than this dt knows: it exports only dt_hal_plugin_v5. dt must
 * refuse it naming its version and the versions dt supports (1 to 4). */
__attribute__((visibility("default"))) const void* dt_hal_plugin_v5(void) { return 0; }
