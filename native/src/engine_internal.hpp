// Engine constructors shared between the engine translation units (not installed).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "fastpersist/engine.hpp"

namespace fastpersist {

/** @brief The threads engine. @throws EngineUnavailable if threads cannot start. */
std::unique_ptr<Engine> make_thread_pool_engine(const EngineOptions& options);

#if FASTPERSIST_HAVE_IO_URING
/** @brief The io_uring engine. @throws EngineUnavailable with the kernel's reason. */
std::unique_ptr<Engine> make_uring_engine(const EngineOptions& options);
/** @brief (usable, reason) for io_uring. */
std::pair<bool, std::string> probe_uring();
#endif

}  // namespace fastpersist
