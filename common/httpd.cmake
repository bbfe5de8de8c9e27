# llmhttpd: common/httpd.c, the metrics port's HTTP server, and
# common/httpd_guard.c, its defence against slow clients (the gateway uses it
# too), on libmicrohttpd.  llm_folder puts every common/*.c into llmcommon;
# both are taken out of it again here so that programs without a metrics port (the
# CLI, benchmarks) do not link libmicrohttpd.
if(TARGET llmcommon)
  pkg_check_modules(MHD IMPORTED_TARGET GLOBAL libmicrohttpd)
  if(NOT MHD_FOUND)
    message(FATAL_ERROR "libmicrohttpd was not found through pkg-config (libmicrohttpd.pc); "
            "the metrics port (common/httpd.c) needs it: install Debian's libmicrohttpd-dev "
            "(scripts/install-deps.sh)")
  endif()
  get_target_property(llm_common_srcs llmcommon SOURCES)
  list(FILTER llm_common_srcs EXCLUDE REGEX "/httpd(_guard)?\\.c$")
  set_property(TARGET llmcommon PROPERTY SOURCES ${llm_common_srcs})
  add_library(llmhttpd STATIC ${CMAKE_CURRENT_SOURCE_DIR}/httpd.c ${CMAKE_CURRENT_SOURCE_DIR}/httpd_guard.c)
  target_compile_options(llmhttpd PRIVATE ${LLM_WARNINGS})
  target_link_libraries(llmhttpd PUBLIC llmcommon PkgConfig::MHD)

  # tests/CMakeLists.txt links every test with the folder libraries it knows;
  # test_httpd also needs this one.  The tests are defined after common/, so
  # the link is added once the top directory has been read.
  function(llm_httpd_link_tests)
    if(TARGET test_httpd)
      target_link_libraries(test_httpd PRIVATE llmhttpd)
    endif()
  endfunction()
  cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL llm_httpd_link_tests)
endif()
