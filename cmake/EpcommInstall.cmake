include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS epcomm EXPORT epcommTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/epcomm DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT epcommTargets NAMESPACE epcomm:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/epcomm)
configure_package_config_file(cmake/epcommConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/epcommConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/epcomm)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/epcommConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/epcommConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/epcommConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/epcomm)
