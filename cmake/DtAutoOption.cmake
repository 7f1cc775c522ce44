# dt_auto_option(VAR DOC): the cache option VAR (AUTO, the default, ON or OFF) of an optional
# part, checked; sets VAR_MODE in the caller's scope to its value in upper case. AUTO builds the
# part where what it needs is found, ON stops configuration where it is not, OFF never builds it.
function(dt_auto_option var doc)
  set(${var} AUTO CACHE STRING "${doc}: AUTO, ON or OFF")
  set_property(CACHE ${var} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${var}}" mode)
  if(NOT mode MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "dt: ${var}='${${var}}' (expected AUTO, ON or OFF)")
  endif()
  set(${var}_MODE ${mode} PARENT_SCOPE)
endfunction()
