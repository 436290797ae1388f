// The one pybind11 file: exposes the native core as fastpersist._native.
//
// Rules kept here: every call that can block releases the GIL; every buffer a
// request reads or writes is kept referenced until the request completes; C++
// errors become OSError subclasses with errno and filename set.
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>
#include <memory>
#include <string>
#include <unordered_map>

#include "fastpersist/buffer.hpp"
#include "fastpersist/checksum.hpp"
#include "fastpersist/crc_pool.hpp"
#include "fastpersist/engine.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/file.hpp"
#include "fastpersist/handle.hpp"
#include "fastpersist/hash.hpp"

namespace py = pybind11;
using namespace fastpersist;

namespace {

py::object g_unexpected_eof_type;
py::object g_engine_unavailable_type;

// OSError(errno, message, filename) picks the subclass (FileNotFoundError,
// PermissionError, ...) from errno by itself.
void raise_io_error(const IoError& e) {
  py::object filename = e.path().empty() ? py::object(py::none()) : py::object(py::str(e.path()));
  py::object exc;
  if (dynamic_cast<const UnexpectedEndOfFile*>(&e) != nullptr) {
    exc = g_unexpected_eof_type(py::str(e.what()));
    exc.attr("filename") = filename;
  } else {
    exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.error_number(), py::str(e.what()), filename);
  }
  exc.attr("operation") = py::str(e.operation());
  exc.attr("native_location") = py::str(e.where());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

std::string fspath(const py::handle& path) {
  return py::str(py::module_::import("os").attr("fspath")(path)).cast<std::string>();
}

FaultSpec parse_fault(const py::object& fault) {
  FaultSpec spec;
  if (fault.is_none()) return spec;
  py::dict d = py::dict(fault);
  spec.enabled = true;
  if (d.contains("nth")) spec.nth = d["nth"].cast<uint64_t>();
  if (d.contains("errno")) spec.error = d["errno"].cast<int>();
  if (d.contains("count")) spec.count = d["count"].cast<uint64_t>();
  if (d.contains("short")) spec.short_io = d["short"].cast<bool>();
  std::string op = d.contains("op") ? d["op"].cast<std::string>() : "write";
  if (op == "write") {
    spec.op = FaultOp::kWrite;
  } else if (op == "read") {
    spec.op = FaultOp::kRead;
  } else if (op == "any") {
    spec.op = FaultOp::kAny;
  } else {
    throw py::value_error("fault op must be 'write', 'read' or 'any', got '" + op + "'");
  }
  if (spec.nth < 1) throw py::value_error("fault nth is 1-based and must be >= 1");
  if (spec.error <= 0 && !spec.short_io) throw py::value_error("fault errno must be a positive errno value");
  return spec;
}

/** AlignedBuffer plus the Python-side release hook (called just before munmap). */
struct PyAlignedBuffer {
  std::unique_ptr<AlignedBuffer> buffer;
  py::object hook = py::none();

  ~PyAlignedBuffer() {
    if (!hook.is_none()) {
      try {
        hook();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("fastpersist AlignedBuffer release hook");
      }
    }
    hook = py::none();
    py::gil_scoped_release release;
    buffer.reset();
  }
};

/** IoHandle plus the objects each in-flight request must keep alive. */
struct PyIoHandle {
  std::unique_ptr<IoHandle> handle;
  std::unordered_map<uint64_t, py::object> keepalive;

  ~PyIoHandle() {
    {
      py::gil_scoped_release release;
      handle.reset();  // waits for everything in flight
    }
    keepalive.clear();
  }

  void sweep() {
    for (uint64_t id : handle->take_finished_ids()) keepalive.erase(id);
  }
};

std::shared_ptr<File> resolve_target(PyIoHandle& self, const py::handle& target, bool write, bool& owns) {
  if (py::isinstance<File>(target)) {
    owns = false;
    return target.cast<std::shared_ptr<File>>();
  }
  if (py::isinstance<py::int_>(target) && !py::isinstance<py::bool_>(target)) {
    const int fd = target.cast<int>();
    const bool direct = self.handle->options().direct;
    owns = false;
    py::gil_scoped_release release;
    return File::borrow(fd, direct);
  }
  const std::string path = fspath(target);
  owns = true;
  py::gil_scoped_release release;
  return self.handle->open_for(path, write);
}

py::object submit(PyIoHandle& self, bool write, uintptr_t ptr, uint64_t nbytes, const py::object& target,
                  uint64_t file_offset, const py::object& keepalive, bool truncate, bool allow_short,
                  bool detached = false) {
  bool owns = false;
  std::shared_ptr<File> file = resolve_target(self, target, write, owns);
  std::shared_ptr<Request> request;
  {
    py::gil_scoped_release release;
    void* buffer = reinterpret_cast<void*>(ptr);
    request = write ? self.handle->submit_write(buffer, nbytes, file, file_offset, owns, truncate, detached)
                    : self.handle->submit_read(buffer, nbytes, file, file_offset, owns, allow_short, detached);
  }
  self.keepalive[request->id()] = py::make_tuple(keepalive, target);
  self.sweep();
  return py::cast(request);
}

py::dict probe_to_dict(const DirectoryProbe& p) {
  py::dict d;
  d["direct"] = p.direct;
  d["reason"] = p.reason;
  d["alignment"] = p.alignment;
  d["memory_alignment"] = p.memory_alignment;
  d["fs_type"] = p.fs_type;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "fastpersist native I/O core (private; use fastpersist.io.engine).";

  // Every exception class of fastpersist is defined in Python, in fastpersist.errors (it imports nothing of
  // fastpersist); the binding raises those very classes, so `except` clauses and pickles see one type.
  py::module_ errors = py::module_::import("fastpersist.errors");
  g_unexpected_eof_type = errors.attr("UnexpectedEndOfFileError");
  g_engine_unavailable_type = errors.attr("EngineUnavailableError");
  m.attr("UnexpectedEndOfFileError") = g_unexpected_eof_type;
  m.attr("EngineUnavailableError") = g_engine_unavailable_type;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      raise_io_error(e);
    } catch (const EngineUnavailable& e) {
      PyErr_SetString(g_engine_unavailable_type.ptr(), e.what());
    }
  });

  // ---------------------------------------------------------------- File
  py::class_<File, std::shared_ptr<File>>(m, "File", R"(A file opened for fastpersist I/O.

Opens a buffered descriptor and, when ``direct`` and the filesystem accepts
it, an O_DIRECT descriptor of the same file. Raises OSError subclasses
(FileNotFoundError, PermissionError, ...) when the open fails.)")
      .def(py::init([](const py::object& path, const std::string& mode, bool direct, bool truncate,
                       const py::object& create, unsigned permissions) {
             const std::string p = fspath(path);
             const OpenMode open_mode = parse_open_mode(mode);
             const bool do_create = create.is_none() ? open_mode != OpenMode::kRead : create.cast<bool>();
             py::gil_scoped_release release;
             return std::make_shared<File>(p, open_mode, direct, truncate, do_create, permissions);
           }),
           py::arg("path"), py::arg("mode") = "r", py::arg("direct") = true, py::arg("truncate") = false,
           py::arg("create") = py::none(), py::arg("permissions") = 0644)
      .def_property_readonly("path", &File::path)
      .def_property_readonly("fd", &File::fd)
      .def_property_readonly("direct_fd", &File::direct_fd)
      .def_property_readonly("direct", &File::direct)
      .def_property_readonly("alignment", &File::alignment)
      .def_property_readonly("memory_alignment", &File::memory_alignment)
      .def_property_readonly("fallback_reason", &File::fallback_reason)
      .def_property_readonly(
          "filesystem", [](const File& f) { return filesystem_type(f.fd(), f.path()); },
          "Name of the filesystem holding the file (\"ext4\", \"tmpfs\", ... or \"0x<magic>\").")
      .def_property_readonly("closed", &File::closed)
      .def_property_readonly("mode", [](const File& f) {
        return f.mode() == OpenMode::kRead ? "r" : f.mode() == OpenMode::kWrite ? "w" : "rw";
      })
      .def("fileno", &File::fd)
      .def("fsync", &File::fsync, py::call_guard<py::gil_scoped_release>(), "Makes the file durable (fsync).")
      .def("truncate", &File::truncate, py::arg("size"), py::call_guard<py::gil_scoped_release>(),
           "Sets the file size.")
      .def("allocate", &File::allocate, py::arg("offset"), py::arg("length"),
           py::call_guard<py::gil_scoped_release>(),
           "Reserves blocks (fallocate). Returns False when the filesystem does not support it.")
      .def("size", &File::size, "Current size in bytes.")
      .def("close", &File::close, py::call_guard<py::gil_scoped_release>(),
           "Closes both descriptors (idempotent); waits until no request uses the file.")
      .def("__enter__", [](std::shared_ptr<File> self) { return self; })
      .def("__exit__", [](File& self, py::args) {
        py::gil_scoped_release release;
        self.close();
      })
      .def("__repr__", [](const File& f) {
        return "<fastpersist File '" + f.path() + "' direct=" + (f.direct() ? "True" : "False") +
               " alignment=" + std::to_string(f.alignment()) + (f.closed() ? " closed" : "") + ">";
      });

  // ---------------------------------------------------------------- AlignedBuffer
  py::class_<PyAlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol(), R"(Page-aligned anonymous memory.

Writable 1-D uint8 buffer: ``torch.frombuffer(buf, dtype=torch.uint8)`` views
it without copying (the tensor keeps the buffer alive). Locked with mlock when
``lock`` and RLIMIT_MEMLOCK allow; else ``locked`` is False and ``lock_error``
says why.)")
      .def(py::init([](size_t nbytes, bool lock, bool huge_pages) {
             auto self = std::make_unique<PyAlignedBuffer>();
             py::gil_scoped_release release;
             self->buffer = std::make_unique<AlignedBuffer>(nbytes, lock, huge_pages);
             return self;
           }),
           py::arg("nbytes"), py::arg("lock") = true, py::arg("huge_pages") = false)
      .def_buffer([](PyAlignedBuffer& self) {
        return py::buffer_info(self.buffer->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(self.buffer->size())}, {1}, false);
      })
      .def_property_readonly("ptr", [](const PyAlignedBuffer& self) { return self.buffer->address(); })
      .def_property_readonly("nbytes", [](const PyAlignedBuffer& self) { return self.buffer->size(); })
      .def_property_readonly("locked", [](const PyAlignedBuffer& self) { return self.buffer->locked(); })
      .def_property_readonly("lock_error", [](const PyAlignedBuffer& self) { return self.buffer->lock_error(); })
      .def_property_readonly("huge_pages", [](const PyAlignedBuffer& self) { return self.buffer->huge_pages(); })
      .def("__len__", [](const PyAlignedBuffer& self) { return self.buffer->size(); })
      .def(
          "set_release_hook", [](PyAlignedBuffer& self, py::object hook) { self.hook = std::move(hook); },
          py::arg("hook"), "Calls ``hook()`` (no arguments) just before the memory is unmapped; None clears it.");

  // ---------------------------------------------------------------- Request
  py::class_<Request, std::shared_ptr<Request>>(m, "Request", "One submitted read or write.")
      .def_property_readonly("id", &Request::id)
      .def_property_readonly("is_write", &Request::is_write)
      .def_property_readonly("nbytes", &Request::nbytes)
      .def_property_readonly("file_offset", &Request::file_offset)
      .def_property_readonly("path", &Request::path)
      .def_property_readonly("done", &Request::done)
      .def_property_readonly("failed", &Request::failed)
      .def_property_readonly("bytes_transferred", &Request::bytes_transferred)
      .def("__repr__", [](const Request& r) {
        return "<fastpersist Request " + std::to_string(r.id()) + (r.is_write() ? " write " : " read ") +
               std::to_string(r.nbytes()) + " bytes at " + std::to_string(r.file_offset()) + " of '" + r.path() +
               "'" + (r.done() ? " done" : "") + ">";
      });

  // ---------------------------------------------------------------- IoHandle
  py::class_<PyIoHandle>(m, "IoHandle", R"(Asynchronous reads and writes of memory ranges to files.

submit_write()/submit_read() return at once; wait() blocks (GIL released) until
every request is done, returns how many completed since the previous wait()
and raises the first error after everything in flight has been reaped.)")
      .def(py::init([](size_t block_size, size_t queue_depth, bool single_submit, bool overlap_events,
                       size_t intra_op_parallelism, const std::string& engine, bool direct, const py::object& fault) {
             HandleOptions options;
             options.block_size = block_size;
             options.queue_depth = queue_depth;
             options.single_submit = single_submit;
             options.overlap_events = overlap_events;
             options.intra_op_parallelism = intra_op_parallelism;
             options.engine = engine;
             options.direct = direct;
             options.fault = parse_fault(fault);
             auto self = std::make_unique<PyIoHandle>();
             py::gil_scoped_release release;
             self->handle = std::make_unique<IoHandle>(options);
             return self;
           }),
           py::arg("block_size") = 1u << 20, py::arg("queue_depth") = 32, py::arg("single_submit") = false,
           py::arg("overlap_events") = true, py::arg("intra_op_parallelism") = 1, py::arg("engine") = "auto",
           py::arg("direct") = true, py::arg("fault") = py::none())
      .def_property_readonly("block_size", [](const PyIoHandle& s) { return s.handle->options().block_size; })
      .def_property_readonly("queue_depth", [](const PyIoHandle& s) { return s.handle->options().queue_depth; })
      .def_property_readonly("single_submit", [](const PyIoHandle& s) { return s.handle->options().single_submit; })
      .def_property_readonly("overlap_events",
                             [](const PyIoHandle& s) { return s.handle->options().overlap_events; })
      .def_property_readonly("intra_op_parallelism",
                             [](const PyIoHandle& s) { return s.handle->options().intra_op_parallelism; })
      .def_property_readonly("engine", [](const PyIoHandle& s) { return s.handle->engine(); })
      .def_property_readonly("direct", [](const PyIoHandle& s) { return s.handle->options().direct; })
      .def_property_readonly("fallback_reason", [](const PyIoHandle& s) { return s.handle->fallback_reason(); })
      .def_property_readonly("faulty", [](const PyIoHandle& s) { return s.handle->options().fault.enabled; })
      .def(
          "submit_write",
          [](PyIoHandle& self, uintptr_t ptr, uint64_t nbytes, const py::object& target, uint64_t file_offset,
             const py::object& keepalive, bool truncate, bool detached) {
            return submit(self, true, ptr, nbytes, target, file_offset, keepalive, truncate, false, detached);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("target"), py::arg("file_offset") = 0,
          py::arg("keepalive") = py::none(), py::arg("truncate") = false, py::arg("detached") = false,
          R"(Starts writing ``nbytes`` from address ``ptr`` to ``target`` (path, fd or File) at ``file_offset``.

A path is created if missing (never O_TRUNC) and closed when the request
completes; ``truncate=True`` sets the file size to ``file_offset + nbytes``
after a successful write. ``keepalive`` is referenced until the request
completes. Open errors raise here; I/O errors are raised by wait(), or by
wait_request() for a ``detached`` request (which wait() neither counts nor waits for).)")
      .def(
          "submit_read",
          [](PyIoHandle& self, uintptr_t ptr, uint64_t nbytes, const py::object& target, uint64_t file_offset,
             const py::object& keepalive, bool allow_short, bool detached) {
            return submit(self, false, ptr, nbytes, target, file_offset, keepalive, false, allow_short, detached);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("target"), py::arg("file_offset") = 0,
          py::arg("keepalive") = py::none(), py::arg("allow_short") = false, py::arg("detached") = false,
          R"(Starts reading ``nbytes`` at ``file_offset`` of ``target`` into address ``ptr``.

Reaching end of file early raises UnexpectedEndOfFileError from wait() unless
``allow_short``; then ``Request.bytes_transferred`` tells how much was read.)")
      .def("wait",
           [](PyIoHandle& self) {
             size_t completed = 0;
             std::exception_ptr error;
             {
               py::gil_scoped_release release;
               try {
                 completed = self.handle->wait();
               } catch (...) {
                 error = std::current_exception();
               }
             }
             self.sweep();  // detached requests of other threads may still be in flight: keep theirs
             if (error) std::rethrow_exception(error);
             return completed;
           })
      .def(
          "wait_request",
          [](PyIoHandle& self, const std::shared_ptr<Request>& request) {
            size_t completed = 0;
            std::exception_ptr error;
            {
              py::gil_scoped_release release;
              try {
                completed = self.handle->wait_request(request);
              } catch (...) {
                error = std::current_exception();
              }
            }
            self.sweep();
            if (error) std::rethrow_exception(error);
            return completed;
          },
          py::arg("request"),
          R"(Blocks (GIL released) until ``request`` is done; returns 1 or raises its error.

Meant for requests submitted with ``detached=True``: each thread waits for its
own request and sees only its own error, whatever other threads do on the handle.)")
      .def("pending", [](const PyIoHandle& self) { return self.handle->pending(); })
      .def("stats",
           [](const PyIoHandle& self) {
             const HandleStats s = self.handle->stats();
             py::dict d;
             d["bytes_direct"] = s.bytes_direct;
             d["bytes_buffered"] = s.bytes_buffered;
             d["requests"] = s.requests;
             return d;
           })
      .def("__repr__", [](const PyIoHandle& s) {
        const HandleOptions& o = s.handle->options();
        return "<fastpersist IoHandle engine=" + o.engine + " block_size=" + std::to_string(o.block_size) +
               " queue_depth=" + std::to_string(o.queue_depth) +
               " intra_op_parallelism=" + std::to_string(o.intra_op_parallelism) +
               " direct=" + (o.direct ? "True" : "False") + ">";
      });

  // ---------------------------------------------------------------- functions
  m.def(
      "probe_directory",
      [](const py::object& path) {
        const std::string p = fspath(path);
        DirectoryProbe probe;
        {
          py::gil_scoped_release release;
          probe = probe_directory(p);
        }
        return probe_to_dict(probe);
      },
      py::arg("path"), "Creates and deletes a probe file: dict(direct, reason, alignment, memory_alignment, fs_type).");
  m.def(
      "memlock_limit",
      []() {
        uint64_t soft = 0, hard = 0;
        memlock_limit(soft, hard);
        auto value = [](uint64_t v) { return v == UINT64_MAX ? py::object(py::none()) : py::object(py::int_(v)); };
        return py::make_tuple(value(soft), value(hard));
      },
      "RLIMIT_MEMLOCK (soft, hard) in bytes; None means unlimited.");
  m.def("engines_compiled", &engines_compiled, "Engines built into this module, best first.");
  m.def("probe_engine", &probe_engine, py::arg("name"), py::call_guard<py::gil_scoped_release>(),
        "(usable, reason) for engine ``name``; reason is '' when usable.");

  // ---------------------------------------------------------------- checksums
  // Pointers come from tensors or AlignedBuffers the caller keeps alive for the call.
  // Below this many bytes the work (~5 us) costs less than giving the GIL away and taking it back,
  // which also hands the interpreter to another thread: 100,000 tiny records paid that 100,000 times.
  constexpr size_t kReleaseGilFrom = 64 << 10;
  m.def(
      "crc32",
      [](uintptr_t address, size_t length, uint32_t crc) {
        if (length < kReleaseGilFrom) return crc32_update(crc, reinterpret_cast<const void*>(address), length);
        py::gil_scoped_release release;
        return crc32_update(crc, reinterpret_cast<const void*>(address), length);
      },
      py::arg("address"), py::arg("length"), py::arg("crc") = 0,
      "CRC-32 (zlib's) of ``length`` bytes at ``address``, continued from ``crc``.");
  m.def(
      "copy_with_crc32",
      [](uintptr_t destination, uintptr_t source, size_t length, uint32_t crc) {
        void* to = reinterpret_cast<void*>(destination);
        const void* from = reinterpret_cast<const void*>(source);
        if (length < kReleaseGilFrom) return copy_with_crc32(to, from, length, crc);
        py::gil_scoped_release release;
        return copy_with_crc32(to, from, length, crc);
      },
      py::arg("destination"), py::arg("source"), py::arg("length"), py::arg("crc") = 0,
      "Copies ``length`` bytes (non-overlapping) and returns their CRC-32 continued from ``crc``; reads the source once.");
  m.def(
      "copy_many",
      [](const std::vector<uintptr_t>& destinations, const std::vector<uintptr_t>& sources,
         const std::vector<size_t>& lengths, bool checksum) {
        if (destinations.size() != sources.size() || sources.size() != lengths.size()) {
          throw std::invalid_argument("copy_many: destinations, sources and lengths differ in length");
        }
        std::vector<uint32_t> crcs(checksum ? sources.size() : 0);
        {
          // One call for thousands of small records: the work runs without the GIL, so
          // pool threads copy while the interpreter goes on unpickling.
          py::gil_scoped_release release;
          for (size_t i = 0; i < sources.size(); ++i) {
            void* to = reinterpret_cast<void*>(destinations[i]);
            const void* from = reinterpret_cast<const void*>(sources[i]);
            if (to == nullptr) {
              if (checksum) crcs[i] = crc32_update(0, from, lengths[i]);
            } else if (checksum) {
              crcs[i] = copy_with_crc32(to, from, lengths[i], 0);
            } else {
              std::memcpy(to, from, lengths[i]);
            }
          }
        }
        return crcs;
      },
      py::arg("destinations"), py::arg("sources"), py::arg("lengths"), py::arg("checksum"),
      "Copies each ``lengths[i]`` bytes from ``sources[i]`` to ``destinations[i]`` (0: no copy) without the "
      "GIL; with ``checksum`` returns each range's CRC-32 (else an empty list).");
  m.def(
      "crc32_of",
      [](py::object data, uint32_t crc) {
        // PyBUF_SIMPLE accepts contiguous buffers only; the view pins the bytes while the GIL is released.
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        uint32_t result;
        {
          py::gil_scoped_release release;
          result = crc32_update(crc, view.buf, static_cast<size_t>(view.len));
        }
        PyBuffer_Release(&view);
        return result;
      },
      py::arg("data"), py::arg("crc") = 0,
      "CRC-32 (zlib's) of a contiguous buffer (bytes, bytearray, memoryview, array), continued from ``crc``.");
  m.def("errno_advice", &errno_advice, py::arg("errno"),
        "What to do about an errno in a failed I/O (as every native error message ends), or \"\".");
  m.def("crc32_combine", &crc32_combine, py::arg("crc_first"), py::arg("crc_second"), py::arg("length_second"),
        "CRC-32 of two ranges back to back from each one's CRC-32 (zlib's crc32_combine).");
  m.def("crc32_accelerated", &crc32_accelerated, "Whether CRC-32 uses carry-less multiplication on this CPU.");
  m.def("crc32_method", &crc32_method, "The CRC-32 method in use on this CPU: 'vpclmul', 'pclmul' or 'table'.");
  m.def("crc32_methods", &crc32_methods, "Every CRC-32 method this CPU can run, slowest first.");
  m.def(
      "crc32_with",
      [](const std::string& method, uintptr_t address, size_t length, uint32_t crc, uintptr_t copy_to) {
        py::gil_scoped_release release;
        return crc32_update_with(method, crc, reinterpret_cast<const void*>(address), length,
                                 reinterpret_cast<void*>(copy_to));
      },
      py::arg("method"), py::arg("address"), py::arg("length"), py::arg("crc") = 0, py::arg("copy_to") = 0,
      "``crc32`` (with ``copy_to``, ``copy_with_crc32``) by the named method, for tests and benchmarks; "
      "ValueError where this CPU cannot run it.");

  py::class_<CrcJob, std::shared_ptr<CrcJob>>(m, "CrcJob", "The CRC-32s of one CrcPool.submit(), filled in by the pool.")
      .def("done", &CrcJob::done, "Whether every range's CRC-32 is known (never blocks).")
      .def("wait", &CrcJob::wait, py::call_guard<py::gil_scoped_release>(), "Blocks (GIL released) until done().")
      .def(
          "crc",
          [](const CrcJob& job, size_t index) {
            if (index >= job.size()) throw py::index_error("CrcJob.crc: no range " + std::to_string(index));
            if (!job.done()) {
              py::gil_scoped_release release;
              job.wait();
            }
            return job.crc(index);
          },
          py::arg("index"), "Range ``index``'s CRC-32, waiting (GIL released) for the job if needed.")
      .def("__len__", &CrcJob::size);
  py::class_<CrcPool>(m, "CrcPool", R"(Native threads computing CRC-32s of memory ranges, without the GIL.

submit() queues one task per range and returns a CrcJob at once; the caller keeps
the memory alive until the job is done. shutdown() runs what is queued and joins
the threads; later submissions (and any in a process forked after the pool
started) are computed on the calling thread.)")
      .def(py::init([](size_t threads) {
             py::gil_scoped_release release;
             return std::make_unique<CrcPool>(threads);
           }),
           py::arg("threads"))
      .def(
          "submit",
          [](CrcPool& pool, const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths) {
            // Kept: queueing takes microseconds, and giving the GIL away here hands the interpreter to
            // another thread at every submission (computed here only after shutdown(), at exit).
            return pool.submit(addresses, lengths);
          },
          py::arg("addresses"), py::arg("lengths"),
          "Queues the CRC-32 of each range (addresses[i], lengths[i]); returns their CrcJob.")
      .def("submit_copies", &CrcPool::submit_copies, py::arg("destinations"), py::arg("sources"), py::arg("lengths"),
           py::arg("populate") = false, py::arg("checksum") = false,
           "Queues a copy of each range (sources[i], lengths[i]) to destinations[i]; returns their CrcJob (done "
           "once every range is copied). With ``populate`` the destinations are a file mapping whose page tables "
           "each task fills first: a range whose pages cannot be had is not copied and its value is the errno "
           "(EFAULT: no room), else every value is 0. With ``checksum`` each value is the range's CRC-32, "
           "computed in the copy's pass.")
      .def("shutdown", &CrcPool::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Runs what is queued, then stops and joins the threads (idempotent).")
      .def_property_readonly("threads", &CrcPool::threads);

  // ---------------------------------------------------------------- 64-bit hashes
  m.def(
      "hash64",
      [](uintptr_t address, size_t length, uint64_t seed) {
        if (length < kReleaseGilFrom) return xxh64(reinterpret_cast<const void*>(address), length, seed);
        py::gil_scoped_release release;
        return xxh64(reinterpret_cast<const void*>(address), length, seed);
      },
      py::arg("address"), py::arg("length"), py::arg("seed") = 0,
      "XXH64 of ``length`` bytes at ``address`` with ``seed`` (the reference implementation's value).");
  m.def(
      "hash64_many",
      [](const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths, uint64_t seed) {
        if (addresses.size() != lengths.size()) {
          throw std::invalid_argument("hash64_many: addresses and lengths differ in length");
        }
        std::vector<uint64_t> hashes(addresses.size());
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < addresses.size(); ++i) {
            hashes[i] = xxh64(reinterpret_cast<const void*>(addresses[i]), lengths[i], seed);
          }
        }
        return hashes;
      },
      py::arg("addresses"), py::arg("lengths"), py::arg("seed") = 0,
      "XXH64 of each ``(addresses[i], lengths[i])`` range with ``seed``, in one call without the GIL.");
}
