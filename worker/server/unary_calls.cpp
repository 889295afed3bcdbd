// UnaryCalls (unary_calls.h): a bounded pool for the Stage service's unary calls.
#include "unary_calls.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <system_error>
#include <thread>

namespace dgr {

namespace {
constexpr auto IDLE_EXIT = std::chrono::seconds(30);   // a thread with nothing to run for this long exits
}

// One call's reactor. gRPC binds a call to its reactor only after the handler returns, and a Finish before that
// parks the status in the reactor's pre-bind backlog, guarded by an absl mutex that TSan cannot see (Debian's
// gRPC and absl are not instrumented): a pool thread finishing a call that fast looked like a race. So the
// handler's thread asks for the initial metadata to be sent (its own backlog, read by that same thread when
// it binds), and the call reaches the pool from OnSendInitialMetadataDone, a reaction after the bind: every
// Finish then goes to the bound call. `ordered()` gives TSan the order of the reactions that gRPC keeps with
// its own (uninstrumented) atomics, as FramesReactor's does.
class UnaryCalls::Reactor final : public grpc::ServerUnaryReactor {
  public:
    Reactor(UnaryCalls * pool, grpc::CallbackServerContext * ctx, std::string member, std::string who, Body body)
        : pool_(pool), ctx_(ctx), member_(std::move(member)), who_(std::move(who)), body_(std::move(body)) {
        ordered();
        StartSendInitialMetadata();
    }
    void OnSendInitialMetadataDone(bool ok) override {
        ordered();
        if (!ok) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away"));
        else pool_->submit(this);
    }
    void OnDone() override {
        ordered();
        delete this;
    }
    // on a pool thread: the body, then the status; nothing of this object is read after Finish
    void run() {
        Body body;
        {
            std::lock_guard<std::mutex> g(order_);
            body = std::move(body_);
        }
        grpc::Status st;
        if (ctx_->IsCancelled()) {                   // the caller gave up while it waited
            st = grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
        } else {
            try {
                st = body();
            } catch (const std::exception & e) {
                st = grpc::Status(grpc::StatusCode::INTERNAL, std::string("the call failed: ") + e.what());
            } catch (...) {
                st = grpc::Status(grpc::StatusCode::INTERNAL, "the call failed (unknown exception)");
            }
        }
        body = nullptr;                              // what the body held goes before the call ends
        // gRPC frees the request and the reply on its own thread right after OnDone, which takes this lock
        // too: TSan sees the body's writes ordered before that
        ordered();
        Finish(st);
    }
    const std::string & member() const { return member_; }
    const std::string & who() const { return who_; }

  private:
    void ordered() { std::lock_guard<std::mutex> g(order_); }
    std::mutex order_;
    UnaryCalls * pool_;
    grpc::CallbackServerContext * ctx_;
    const std::string member_, who_;
    Body body_;
};

grpc::ServerUnaryReactor * UnaryCalls::start(grpc::CallbackServerContext * ctx, const std::string & member,
                                             const std::string & who, Body body) {
    return new Reactor(this, ctx, member, who, std::move(body));
}

void UnaryCalls::submit(Reactor * r) {
    const std::string & member = r->member();
    std::string refusal;
    bool spawn = false;
    {
        std::lock_guard<std::mutex> g(mu_);
        size_t & mine = per_member_[member];
        if (stopping_) {
            refusal = r->who() + " is shutting down";
        } else if (b_.per_member && mine >= b_.per_member) {
            refusal = r->who() + ": this member has " + std::to_string(mine) + " calls running or waiting here, the most " +
                      "one member may (--max-rpc-per-member " + std::to_string(b_.per_member) +
                      "): retry when one of them has finished";
        } else if (q_.size() >= b_.queued + waiting_threads_) {
            refusal = r->who() + " is busy: " + std::to_string(running_) + " calls running and " + std::to_string(q_.size()) +
                      " waiting (--max-rpc-threads " + std::to_string(b_.threads) + "): retry shortly";
        }
        if (!refusal.empty()) {
            if (mine == 0) per_member_.erase(member);
            ++refused_;
        } else {
            ++mine;
            q_.push_back(Call{r, member});
            // a thread for every call no idle thread will take (an idle thread already woken for an earlier
            // call still counts as waiting until it runs, so compare the queue with them, never test for 0)
            if (q_.size() > waiting_threads_ && threads_ < b_.threads) {
                ++threads_;
                spawn = true;
            }
        }
    }
    if (!refusal.empty()) {
        r->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, refusal));
        return;
    }
    if (spawn) {
        try {
            std::thread([this] { loop(); }).detach();
        } catch (const std::system_error &) {        // no thread to be had: the ones there take the call
            std::deque<Call> orphans;                // ... unless there are none: refuse what waits
            {
                std::lock_guard<std::mutex> g(mu_);
                if (--threads_ == 0) {
                    orphans.swap(q_);
                    for (Call & c : orphans) done(c.member);
                }
            }
            for (Call & c : orphans) {
                c.reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, c.reactor->who() +
                                               " cannot start a thread: retry shortly"));
            }
        }
    } else {
        work_.notify_one();
    }
}

void UnaryCalls::loop() {
    std::unique_lock<std::mutex> lk(mu_);
    while (true) {
        ++waiting_threads_;
        bool woke = work_.wait_for(lk, IDLE_EXIT, [&] { return !q_.empty() || stopping_; });
        --waiting_threads_;
        if (q_.empty() && (stopping_ || !woke)) break;
        Call c = std::move(q_.front());
        q_.pop_front();
        ++running_;
        lk.unlock();
        c.reactor->run();                            // (the reactor may be gone once it returns)
        lk.lock();
        --running_;
        done(c.member);
    }
    --threads_;
    if (threads_ == 0) idle_.notify_all();
}

void UnaryCalls::done(const std::string & member) {
    auto it = per_member_.find(member);
    if (it != per_member_.end() && --it->second == 0) per_member_.erase(it);
}

UnaryCalls::Counts UnaryCalls::counts() const {
    std::lock_guard<std::mutex> g(mu_);
    return Counts{running_, q_.size(), threads_, per_member_.size(), refused_};
}

UnaryCalls::~UnaryCalls() {
    std::unique_lock<std::mutex> lk(mu_);
    stopping_ = true;
    work_.notify_all();
    idle_.wait(lk, [&] { return threads_ == 0; });
}

}  // namespace dgr
