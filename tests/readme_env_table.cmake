# cmake -DPLAN=<epcomm-plan> -DREADME=<README.md> -P readme_env_table.cmake: fails unless the README contains the table
# that `epcomm-plan --env` prints, verbatim.
execute_process(COMMAND ${PLAN} --env OUTPUT_VARIABLE table RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "epcomm-plan --env failed (${rc})")
endif()
string(STRIP "${table}" table)
file(READ ${README} readme)
string(FIND "${readme}" "${table}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md's EPCOMM_* table differs from `epcomm-plan --env`; paste its output into README.md")
endif()
