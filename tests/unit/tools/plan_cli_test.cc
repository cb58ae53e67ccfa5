// The epcomm-plan executable, run as a real process: output and exit codes (0 ok, 2 bad arguments).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace {

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr together
};

// `env`: variable assignments for the process (e.g. "EPCOMM_NVLINK_THREADS=300").
Result runPlan(const std::string& args, const std::string& env = "") {
  Result r;
  const std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(EPCOMM_PLAN_EXE) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

bool has(const Result& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

TEST(PlanCli, DecodeTable) {
  const Result r = runPlan("--config decode --world 8");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "total per GPU (rank): 680.75 MiB")) << r.output;
  EXPECT_TRUE(has(r, "outExpertXScale")) << r.output;
}

TEST(PlanCli, PackedDpAndBackend) {
  const Result r = runPlan("--config decode --world 8 --dp 2 --rank 3 --layout packed --padding 64 --backend nvshmem");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "D=2 pad=64 packed rank=3")) << r.output;
  EXPECT_TRUE(has(r, "nvshmem")) << r.output;
}

TEST(PlanCli, Env) {
  const Result r = runPlan("--env");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "| variable | default | meaning |")) << r.output;
  EXPECT_TRUE(has(r, "| `EPCOMM_TIMEOUT_MS` | `10000` |")) << r.output;
}

TEST(PlanCli, Reference) {
  const Result r = runPlan("--reference --tokens 16");
  EXPECT_EQ(r.code, 0) << r.output;
  for (const char* name : {"| decode ", "| prefill ", "| small ", "| qwen3 "}) EXPECT_TRUE(has(r, name)) << r.output;
  EXPECT_FALSE(has(r, "MISMATCH")) << r.output;
}

TEST(PlanCli, BadArgumentsExitWith2) {
  struct Case {
    const char* args;
    const char* message;
  };
  for (const Case& c : {Case{"--config decode", "--world is required"}, Case{"--world 8", "--config is required"},
                        Case{"--config mixtral --world 8", "unknown standard config 'mixtral'"},
                        Case{"--config decode --world eight", "--world needs a non-negative integer, got 'eight'"},
                        Case{"--config decode --world -8", "--world needs a non-negative integer"},
                        Case{"--config decode --world 3", "numExperts 256 is not a multiple of worldSize 3"},
                        Case{"--config decode --world 8 --padding 3", "expertPadding 3 is not a power of two"},
                        Case{"--config decode --world 8 --layout ragged", "--layout must be batched or packed"},
                        Case{"--config decode --world 8 --backend ib", "--backend must be"},
                        Case{"--config decode --world 8 --rank 8", "rank 8 is out of range"},
                        Case{"--config decode --world", "--world needs a value"},
                        Case{"--frobnicate", "unknown argument '--frobnicate'"}}) {
    const Result r = runPlan(c.args);
    EXPECT_EQ(r.code, 2) << c.args << ": " << r.output;
    EXPECT_TRUE(has(r, c.message)) << c.args << ": " << r.output;
  }
}

TEST(PlanCli, NvlinkThreadsFromTheEnvironment) {
  const Result ok = runPlan("--config decode --world 2 --backend nvlink --tokens 128", "EPCOMM_NVLINK_THREADS=512");
  EXPECT_EQ(ok.code, 0) << ok.output;
  // The nvlink plan (and its knobs' checks) exists only in builds with CUDA; without it the plan says so.
  if (has(ok, "not built in this build")) GTEST_SKIP() << "the nvlink backend is not in this build";
  const Result bad = runPlan("--config decode --world 2 --backend nvlink", "EPCOMM_NVLINK_THREADS=300");
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_TRUE(has(bad, "EPCOMM_NVLINK_THREADS must be 0 (automatic), 256 or 512, not 300")) << bad.output;
}

TEST(PlanCli, Help) {
  const Result r = runPlan("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(has(r, "usage: epcomm-plan")) << r.output;
}

}  // namespace
