#pragma once
/**
 * @file check.hpp
 * @brief The one assertion of the native tests: prints file:line and the condition, returns 1 from main.
 */
#include <cstdio>

#define EXPECT(cond)                                                                 \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)
